// filled by the test support helper
