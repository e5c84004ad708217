"""Judging: label sets with calibration, and order-debiased pairwise judgments."""
