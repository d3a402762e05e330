"""genq-batch: the batch client. It talks to genq's HTTP API only, so it imports nothing of the server."""
