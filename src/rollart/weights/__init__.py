"""Versioned weights, from the trainer's step to the inference worker's reload.

Importing the package imports nothing heavy: torch and vLLM are imported by the modules that
need them (``collective``, ``vllm_engines``, ``vllm_ext``), so tools can import the rest.

Weight path
-----------
A version ``v`` is the number of optimizer steps applied (0 = the checkpoint the workers load).
Who owns what: the trainer owns the versions it made and which workers each push reached; a
worker owns what it staged and the version it serves; the controller only decides *when* a
worker applies (paper §6.2), asking the trainer one question through its port
(``rollart.controller.ports.TrainerBackend``): ``push_weights(v, workers)`` = "return once v is
ready on these workers", with ``push_needs_pause`` saying whether that writes into the serving
models (then the workers are paused first).

ZeroMQ path (``[trainer] weight_transfer = "zmq"``, the default; cross-cluster):

1. ``rollart.trainer.step.train_step`` updates the parameters; ``TrainerService.train``
   (``TrainBatch(version=v - 1)``) then snapshots them (``push.snapshot_parameters``) and
   ``push.WeightPublisher.publish(v, ...)`` starts pushing in the background, so the transfer
   overlaps rollout (§6.3).
2. Per registered worker, ``InferenceClient.push_weights`` cuts the tensors into buckets
   (``buckets.plan_buckets``, ``[trainer] bucket_bytes``) and sends each as a ``WeightBucket``
   with raw tensor frames and a CRC32 (``buckets.encode_bucket``).
3. On the worker, ``receiver.WeightReceiver.weight_bucket`` has ``staging.WeightStager`` check the
   CRC, names and shapes (``buckets.decode_bucket``, ``staging.CheckpointLayout``) and write the
   bucket as a safetensors file under ``/dev/shm``; nothing is applied yet.
4. The controller (``rollart.controller.training.weightsync``) asks ``WaitPublished(v, addresses)``: the
   trainer's ``WeightPublisher.ensure_staged`` waits for v's push and pushes v itself to any of
   those workers the push missed (a resumed run's, one registered later).
5. At its pause point the controller sends ``ApplyWeights(v)``: ``WeightReceiver.apply_weights``
   takes the complete staged version (``WeightStager.take``), pauses the engine (keep the KV),
   reloads it in the engine process through the vLLM worker extension
   (``vllm_ext.WeightSyncExtension.rollart_reload_weights``: file paths cross the process
   boundary, never tensors), resets the prefix cache, labels new tokens with v and resumes.

Collective path (``weight_transfer = "nccl"`` on GPUs, ``"gloo"`` on CPUs): nothing is staged.
Step 1 makes v without pushing; with the workers paused, the controller sends
``BroadcastVersion(v)`` and ``collective.CollectivePublisher.broadcast`` drives vLLM's weight
transfer engines through ``WeightTransferInit`` / ``Start`` / ``Update`` / ``Finish`` messages
(``collective.WorkerGroupClient``), which ``WeightReceiver.transfer_*`` hand to the engine
(``vllm_engines``: vLLM's NCCL engine, or its gloo twin) that loads v into the serving model;
``ApplyWeights(v)`` then only relabels tokens and resets the prefix cache. Each new group first
proves that every rank holds the run key (``membership``: HMAC of a per-group nonce sent over
the CURVE RPC, all-gathered over the group); a group failing it is dropped before any weight
crosses it.

Delta transfer (``[trainer] weight_delta = "xor" | "sparse"``, ZeroMQ path only): the trainer
keeps fp32 masters and rounds each version to ``weight_wire_dtype`` once; per worker,
``sender`` sends a version as ``WeightDelta`` buckets against the exact base version that worker
holds (``delta``: XOR or sparse index/value, zstd, CRC32 of the rebuilt bucket), and a full
version every ``weight_full_every`` versions and to new or lagging workers. On the worker,
``basestate.WorkerBases`` rebuilds a delta only on the base it names (else ``NeedFullVersion``,
and the trainer resends in full), then stages it like a full bucket.

Modules: ``buckets`` (frames, bucketing, CRC32), ``delta`` (codec, wire dtype), ``sender``
(trainer: per-worker full-or-delta choice), ``basestate`` (worker: delta bases), ``push`` (trainer: point-to-point push),
``collective`` (trainer: collective broadcast), ``membership`` (the group's proof of the run
key), ``staging`` and ``receiver`` (worker: staging and
the request handlers), ``vllm_ext`` and ``vllm_engines`` (inside vLLM: reload and the gloo
engine). The controller's side (``rollart.controller.training.weightsync`` and
``rollart.controller.training.remote.RemoteTrainer``) stays in the controller: no component imports it.
"""
