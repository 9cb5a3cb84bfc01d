"""Weight push: bucketing, the trainer-side sender, and the driver-side push inside the update bracket.

Protocol: docs/weights.md.
"""
