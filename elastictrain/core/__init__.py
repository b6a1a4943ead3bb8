"""The ground floor: errors, the config, the states and events, logging, signals, progress records, process set-up. Imports nothing else of the package."""
