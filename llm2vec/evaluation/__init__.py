"""MTEB evaluation of LLM2Vec models (mteb 2.x); every function takes the files it reads as arguments."""
