"""What each head does and whether it matters: pattern labels (:mod:`.labels`)."""
