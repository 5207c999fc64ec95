"""Which draft each request runs with, and which drafts stay resident: scheduler, policies,
working set, and the predictor with its features."""
