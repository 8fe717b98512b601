"""Example tasks written as a user would write them (``ddloco up --task examples.cnn:task``)."""
