"""Developer tooling that makes the shipped models: draft training, profiling traces,
predictor fitting (torch and scikit-learn are imported only here)."""
