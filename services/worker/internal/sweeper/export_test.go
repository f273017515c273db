package sweeper

// The sweep's statements, for the plan test.
const (
	ExpireSQL  = expireSQL
	RequeueSQL = requeueSQL
)
