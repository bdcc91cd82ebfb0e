"""Run the planned steps, re-check safety right before acting, undo a half-done stage; claims."""
