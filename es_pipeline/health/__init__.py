"""Health: what a pipeline's operators watch. `es-pipeline metrics` (exporter.py) serves it to Prometheus, whose
alert rules (alerts.yml) say when to act; `es-pipeline status` prints it for a person (watch.py).
docs/operations.md has every metric, every alert and the command that answers it."""
