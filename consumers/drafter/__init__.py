"""The DFlash drafter itself: its model, block layout, loss, fused elementwise kernels and MASK row."""
