"""What a job shows about itself: Prometheus metrics (metrics.py), the run's event log (events.py) and
the Runtime wrapper that measures training and sampling (metered.py). Neutral: the gateway may import it,
and it imports nothing from train/, rollout/, engines/ or weights/ (those call into it)."""
