"""Planning past one machine: the M->N planner the transports run, fed with whole-cluster
layouts (`layouts`), large models' tensor lists (`models`), a host map and link classes
(`cluster`), and a pipeline model of the update (`simulate`); `scenario.plan_cluster` runs one
question end to end and `wtransfer plan` prints it."""
