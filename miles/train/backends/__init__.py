"""Trainer backends behind one protocol (base.TrainBackend)."""
