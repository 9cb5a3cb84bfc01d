"""Where the job is put together: the only code that imports both the gateway and the runtime's
implementations.

`serve` is the driver's process (`python -m miles.driver.serve RUN_DIR/preset.yaml`: phases, the liveness
loop, the exit code); `bringup` turns a resolved preset into Ray, engines, trainers and a gateway;
`catalog` brings up a preset's model catalog; `elastic` starts the elastic loop; `local_server` composes the
gateway over the one-process runtime (tests, experiments).
"""
