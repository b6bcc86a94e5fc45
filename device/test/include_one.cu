/* Empty on purpose: the build compiles it once per public device header,
 * given with -include, so each header must stand on its own. */
