"""Load generators and benchmark scripts."""
