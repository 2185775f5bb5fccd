"""What people read of a run: metric sinks (TensorBoard, MLflow), the loss curve and the
report's rendering. Plain code: no Prefect (tasks/ publishes it) and no torch."""
