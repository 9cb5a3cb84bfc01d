"""The job script's steps on the nodes, around the driver: plan the roles (`roles`), claim ports
(`ports`), find a node's IP and wait for Ray (`nodes`), and watch the gateway's healthz (`monitor`, the
watchdog that ends a job whose trainer died). Each is `python -m miles.job.<step>`; each is light (no
torch; Ray only once the head answers) so it starts in well under a second on a busy head node."""
