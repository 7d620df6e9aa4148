"""The training loop: `Trainer` and its one `step()`, the step, batches staged on the device, its config and state."""
