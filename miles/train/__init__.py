"""Trainers: backends, losses, preflight, data parallel, Ray trainer cells and the TrainerController."""
