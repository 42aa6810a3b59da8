"""What a run reports: step metrics, transcripts, event-loop health, stall reports."""
