"""Plumbing: what the commands share (inventory, series, SSH transport, the shipped agent, run sessions,
reporting, preflight). Nothing here imports `patchctl.commands`."""
