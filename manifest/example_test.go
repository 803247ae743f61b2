package manifest_test

import (
	"fmt"
	"strings"

	"github.com/outboxrelay/outboxrelay/manifest"
)

// A manifest file is checked and normalized before it is registered: the
// items are sorted by id, so the same approval in another order is the same
// job, and a malformed item is refused by name.
func ExampleParse() {
	spec, err := manifest.Parse(strings.NewReader(`{
	  "job_id": "festival-cancel", "tenant": "alien-desserts",
	  "target": {"table": "orders", "match_fields": ["qty"]},
	  "transition": {"from": "pending", "to": "cancelled"},
	  "chunk_size": 10,
	  "items": [
	    {"id": 15, "revision": 1, "fields": {"qty": 2}},
	    {"id": 4,  "revision": 3, "fields": {"qty": 1}}
	  ]}`))
	if err != nil {
		panic(err)
	}
	for _, it := range spec.Items {
		fmt.Println(it.ID, it.Revision, string(it.Fields["qty"]))
	}
	fmt.Println(spec.Topic)

	_, err = manifest.Parse(strings.NewReader(`{
	  "job_id": "j", "tenant": "t", "target": {"table": "orders", "match_fields": ["qty"]},
	  "transition": {"from": "pending", "to": "cancelled"}, "chunk_size": 10,
	  "items": [{"id": 1, "revision": 1, "fields": {"qty": 2}}, {"id": 2, "revision": 1}]}`))
	fmt.Println(err)
	// Output:
	// 4 3 1
	// 15 1 2
	// outboxrelay.orders
	// invalid manifest: items[1] (id 2): fields.qty is missing (target.match_fields lists it)
}
