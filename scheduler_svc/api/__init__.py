"""The scheduler's API edge: the gRPC server and one servicer + wire module per protocol (native Generation, TGIS, the gateway's VllmEngine, worker Registry)."""
