"""The model catalog: device pool, instance state machine, tenancy, leases, and the controller that
alone writes allocation state. Pure logic; the Ray instance backend lives with the runtime."""
