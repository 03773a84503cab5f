"""Models made elsewhere: Hugging Face model directories as a run's starting point (`hf`)."""
