-- +goose Up
-- Tracing (docs/configuration.md, OpenTelemetry): the W3C traceparent of the
-- CreateCommand call that queued a command, so the gateway's dispatch and
-- result spans join the caller's trace. NULL when tracing is off or the call
-- carried no span. Adding a nullable column without a default rewrites
-- nothing and takes only a brief lock.
ALTER TABLE commands ADD COLUMN traceparent text
    CHECK (traceparent IS NULL OR length(traceparent) BETWEEN 1 AND 128);

-- +goose Down
ALTER TABLE commands DROP COLUMN traceparent;
