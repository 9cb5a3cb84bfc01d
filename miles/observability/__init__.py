"""What a job shows about itself: Prometheus metrics (metrics.py) and the run's event log (events.py);
the Runtime wrapper that measures training and sampling with them is miles.runtime.metered (it implements
the seam, which sits above this package). Neutral: the gateway may import it, and it imports nothing from
train/, rollout/, engines/ or weights/ (those call into it)."""
