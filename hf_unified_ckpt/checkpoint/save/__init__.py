"""The save: one algorithm (`saving`) cut where the snapshot is taken, the synchronous and asynchronous drivers
(`async_save`), where its second half runs (`executors`, `writer_process`), the snapshot and its device copies, what
a save persists as data (`persist`), the plan from a partition rule and the records on their way to rank 0
(`rule_plan`, `record_tree`), and the EMA of the weights, which shares the snapshot. Imports `folder` and `write`."""
