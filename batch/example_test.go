package batch_test

import (
	"fmt"

	"github.com/outboxrelay/outboxrelay/batch"
)

func ExampleParseSpec() {
	spec, err := batch.ParseSpec([]byte(`
job: records
source:
  table: source_records
  cursor: [created_at, id]
  version: version
  deleted: deleted_at
  partition: tenant_id
  filter:
    - {column: tenant_id, op: in, values: [acme, globex]}
document:
  drop_nulls: true
  fields:
    - {name: id, from: id}
    - {name: title, from: payload.title, transforms: [trim], type: string, required: true}
    - {name: tag, from: payload.tag, transforms: [trim, lower]}
processor_version: v1
chunk: {size: 2000, target_duration: 2s}
errors: {policy: quarantine}
`), ".yaml")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(spec.Topic, spec.Chunk.Size, spec.Chunk.Min, spec.Chunk.Max, spec.Errors.Policy, spec.Scope().Hash()[:12])
	// Output: outboxrelay.records 2000 100 20000 quarantine 04eb55ac67e5
}
