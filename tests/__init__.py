"""The test suite, a package: pytest imports each test module once, under the name the modules
import one another by (tests.test_parity), so the parity launches test_checkpoint shares are
run once, not once per name."""
