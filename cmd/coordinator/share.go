package main

import (
	"fmt"
	"strings"

	"github.com/kvtier/kvtier/coordinator"
)

// shareGroupsFlag is serve's --share-group NAME=INSTANCE,INSTANCE[,...]
// (repeatable, or several groups separated by ';' in one value, as a
// config file needs: a key appears there once):
// coordinator.Config.ShareGroups.
type shareGroupsFlag []coordinator.ShareGroup

func (f *shareGroupsFlag) String() string {
	if f == nil {
		return ""
	}
	var out []string
	for _, g := range *f {
		out = append(out, g.Name+"="+strings.Join(g.Instances, ","))
	}
	return strings.Join(out, ";")
}

func (f *shareGroupsFlag) Set(s string) error {
	for _, one := range strings.Split(s, ";") {
		g, err := coordinator.ParseShareGroup(strings.TrimSpace(one))
		if err != nil {
			return fmt.Errorf("--share-group: %w", err)
		}
		*f = append(*f, g)
	}
	return nil
}
