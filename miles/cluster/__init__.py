"""Ray bring-up helpers for the driver, node identity, and placement of trainers and engines on GPUs."""
