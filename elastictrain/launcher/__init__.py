"""What starts workers, and never imports torch: the elastictrain-run wrapper, the environment it reads, warm starts, the rendezvous handler."""
