"""HTTP server: `polyvec serve MODEL`."""
