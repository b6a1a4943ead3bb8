"""Is this step sound: anomaly checks, the agreed skip/update decision, replica fingerprints, the watchdog and hang reports."""
