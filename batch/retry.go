package batch

import (
	"errors"
	"time"
)

// maxPartitionBackoff caps the doubling wait between automatic retries of a
// failed partition.
const maxPartitionBackoff = 10 * time.Minute

// permanentFailure: errors that another attempt would meet again.
func permanentFailure(err error) bool {
	var bad *BadRowError
	return errors.As(err, &bad) || errors.Is(err, ErrSpec) || errors.Is(err, ErrCheckpointIncompatible) ||
		errors.Is(err, ErrCheckpointInvariant) || errors.Is(err, ErrSkipLimit)
}
