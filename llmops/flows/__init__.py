"""The Prefect side: the training and retraining flows and their tasks, remote stages on work pools, the Prefect API a
run talks to, deployments with their pools, limits and automations, and events; the sweep, whose trials' stages go to
those pools. Out of the stage keys: no stage runs it."""
