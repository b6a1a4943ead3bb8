"""The snapshot itself: its format, writing it (durable and fast tiers, sharded or whole, in the background), restoring it, survivor copies."""
