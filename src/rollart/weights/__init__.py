"""Versioned weights: wire dtype, delta codec and the bases both ends hold for delta transfer."""
