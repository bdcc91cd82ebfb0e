"""The node's own records under stateDir: intents, created paths,
allowances, and the atomic JSON writer they share."""
