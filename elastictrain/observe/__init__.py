"""What operators watch: goodput accounting, stragglers, Prometheus metrics, plots, experiment trackers."""
