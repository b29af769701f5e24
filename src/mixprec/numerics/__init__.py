"""Numerics: number formats, emulation, per-layer ranges, differential checks against fp32."""
