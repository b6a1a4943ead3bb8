"""The elastictrain command: train, snapshots list/show/export, plot."""
