"""Multi-turn episodes: the policy acts, tools and environments answer, until an episode ends."""
