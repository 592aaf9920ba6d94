"""Versioned weight publication from learner rank 0 to every actor."""
