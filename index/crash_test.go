package index_test

const crashChildEnv = "KVTIER_INDEX_CRASH_CHILD"
