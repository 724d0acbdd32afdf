"""Triton kernels, one module per op. Imports nothing of the project but small shared helpers here."""
