"""What every process of genq agrees on: its settings, what a job asks for (fields and request schema), the
Redis message that says "job X is ready to run", the token events and the deltas they carry, and the output
shapes of log probabilities. The API, the workers and the job store import it; it imports none of them, nor
torch, Flask or SQLAlchemy."""
