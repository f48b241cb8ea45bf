"""Router training: the min-max objective, the optimizer and the jitted train step."""
