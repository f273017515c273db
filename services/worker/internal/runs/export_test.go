package runs

// FinishedRunsSQL is finishedRunsSQL, for the plan test.
const FinishedRunsSQL = finishedRunsSQL
