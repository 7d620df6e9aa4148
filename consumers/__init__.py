"""Drafter consumers: the DFlash drafter, its training loop, checkpoints and data-parallel ranks.

What the command (consume_command.py -> consumer_process.run) and the broker link call:
  runtime.target_heads.load_target_heads(path, device=, dtype=) -> TargetHeads  (embed + lm_head only)
  train.TrainConfig                                                       (all training options)
  train.train(cfg, heads, batches, dist=, ckpt_root=, runs_dir=, run_config=, hooks=) -> TrainState
  train.Hooks(on_step, on_checkpoint, queue, stop, after_step, before_step, stats)  (ack, commit, figures, stop, eval)
  train.Trainer: .step() one optimizer step; .state_dict()/.load_state_dict() (checkpoints and heals)
  live_eval.LiveEval(heads, signal, every, stats=, real=).before_step     (--eval-every; real_tau.RealTauSet)
  batch.Batch (protocol/batch.py) / Batch.owned(dtype, device)          (the one batch type; its own tensors to train)
  staging.BatchStager(batches, device, dtype)                             (the next batch made ready on a thread)
  dist.Dist.init(...) / Dist.from_torchrun(device)                        (gloo on CPU, NCCL on GPU)
  dist.DistGroup                               (what the loop asks of a group: Dist, elastic.ElasticDist)
  checkpoint.resolve_checkpoint(ref, runs_dir)      (protocol.training_signal.SignalMismatch: another signal)
  join.* (hello config, run facts, resume point, ranks), broker_hooks.BrokerHooks / broker_batches
"""
