"""Calibration: data -> capture -> statistics -> solve / clip fit -> artifact, with scale-out (distributed, sharded capture) and checkpoints."""
